"""Incremental detokenization and stop-string handling.

Text is produced by decoding a sliding window of tokens and taking what the newest tokens add;
text that ends in an incomplete UTF-8 sequence (U+FFFD) is held back until the next token
completes it, so a multi-byte character is never split across outputs.

The window stays short: tokens that add no text (skipped special tokens, ids the tokenizer does
not know, e.g. a dummy-weight model with a larger vocabulary) or a run of U+FFFD longer than any
UTF-8 sequence (invalid bytes, released as U+FFFD) move it on, so each token costs O(1).
"""

from dataclasses import dataclass, field

# A UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens; hold no longer than that.
MAX_HELD_TOKENS = 4
# Tokens of left context kept when the window moves on without new text.
CONTEXT_TOKENS = 4


@dataclass
class IncrementalDetokenizer:
    """Turns a growing token list into a growing string; one instance per request."""

    tokenizer: object
    prompt_token_ids: list[int]
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    text: str = ""  # released text (stop strings and held-back tails excluded)
    _pending: str = ""  # decoded but not yet released (may start a stop string)
    _prefix_offset: int = 0
    _read_offset: int = 0
    _tokens: list[int] = field(default_factory=list)
    _backend: object = None

    def __post_init__(self) -> None:
        # Start the window a few tokens back into the prompt so the first output token decodes
        # with its left context (leading-space handling of BPE / sentencepiece).
        tail = self.prompt_token_ids[-5:]
        self._tokens = list(tail)
        self._prefix_offset = 0
        self._read_offset = len(tail)
        # The Rust tokenizer directly (transformers' decode first checks every id in Python),
        # unless the tokenizer post-processes decoded text (clean_up_tokenization_spaces).
        self._backend = None
        if not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = getattr(self.tokenizer, "backend_tokenizer", None)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token; returns the stop string if one now matched, else None."""
        self._tokens.append(token_id)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        unread = len(self._tokens) - self._read_offset
        if full_text.endswith("\ufffd") and unread <= MAX_HELD_TOKENS:
            return None  # an incomplete character: wait for its next byte
        if len(full_text) <= len(prefix_text):
            if unread > MAX_HELD_TOKENS:  # nothing visible for a while: move the window on
                self._read_offset = len(self._tokens)
                self._prefix_offset = max(self._prefix_offset,
                                          self._read_offset - CONTEXT_TOKENS)
            return None
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._pending += new_text
        return self._release()

    def _release(self) -> str | None:
        for stop in self.stop:
            index = self._pending.find(stop)
            if index >= 0:
                end = index + len(stop) if self.include_stop_str_in_output else index
                self.text += self._pending[:end]
                self._pending = ""
                return stop
        hold = max((len(s) - 1 for s in self.stop), default=0)
        # keep back a tail that could be the start of a stop string
        keep = 0
        for n in range(min(hold, len(self._pending)), 0, -1):
            tail = self._pending[-n:]
            if any(s.startswith(tail) for s in self.stop):
                keep = n
                break
        cut = len(self._pending) - keep
        self.text += self._pending[:cut]
        self._pending = self._pending[cut:]
        return None

    def flush(self) -> None:
        """At the end of generation, release whatever was held back (an unfinished character
        too, as U+FFFD: the text then equals a decode of all the tokens)."""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) > len(prefix_text):
            self._pending += full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._tokens)
        self.text += self._pending
        self._pending = ""

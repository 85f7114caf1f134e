"""`--record-decode-steps PATH`: the decode batches a server really runs, for kernel benchmarks
to replay (`read_decode_steps` reads them back).

One JSON line per step that decodes, `{"q_len": 1, "seq_lens": [L_1, ..., L_B]}`: the query
rows per request and each decoding request's length including the token of this step (the
`seq_lens` the decode kernel reads). The runner of rank 0 records from the host-side positions it
already has (no device sync): under pipelined speculation a verification's lengths count the
previous step's drafts as accepted (up to k more than the kernel reads). The file stops
growing at `max_bytes` (one INFO line says so), so a long-running server cannot fill its disk;
a path that cannot be written fails the start.
"""

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)
DEFAULT_MAX_BYTES = 64 << 20


class DecodeStepRecorder:
    """Appends decode steps to `path` until `max_bytes` are written."""

    def __init__(self, path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        try:
            # line-buffered: each step reaches the file as it is recorded (the engine may be
            # killed rather than closed)
            self._file = open(path, "w", encoding="utf-8", buffering=1)  # noqa: SIM115
        except OSError as exc:
            raise ValueError(f"--record-decode-steps {path}: cannot write it ({exc})") from None
        self.path, self.max_bytes, self.written, self.steps = str(path), max_bytes, 0, 0

    def record(self, seq_lens: list[int], q_len: int = 1) -> None:
        """One decode step: each decoding request's length (this step's token included)."""
        if self._file is None or not seq_lens:
            return
        line = json.dumps({"q_len": q_len, "seq_lens": seq_lens}, separators=(",", ":")) + "\n"
        if self.written + len(line) > self.max_bytes:
            logger.info("decode-step record %s is full (%d steps, %d bytes); recording stops",
                        self.path, self.steps, self.written)
            self.close()
            return
        self._file.write(line)
        self.written += len(line)
        self.steps += 1

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_decode_steps(path: str | Path) -> list[tuple[int, list[int]]]:
    """The recorded steps as (q_len, seq_lens); ValueError naming the line that is not one."""
    steps = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            step = json.loads(line)
            q_len, seq_lens = int(step["q_len"]), [int(n) for n in step["seq_lens"]]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: not a decode step ({line[:80]!r})") from None
        if q_len < 1 or not seq_lens or min(seq_lens) < 1:
            raise ValueError(f"{path}:{number}: q_len and every length must be >= 1")
        steps.append((q_len, seq_lens))
    return steps

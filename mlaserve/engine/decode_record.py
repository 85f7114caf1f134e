"""`--record-decode-steps PATH`: the decode batches a server really runs, for kernel benchmarks
to replay (`read_decode_steps` reads them back).

One JSON line per step that decodes, `{"q_len": 1, "seq_lens": [L_1, ..., L_B], "plan_batch":
P, "plan_len": N}`: the query rows per request, each decoding request's length including the
token of this step (the `seq_lens` the decode kernel reads), and the batch size and length bound
the step's decode plan was made for: a CUDA graph's captured size (its rows past B have no
keys) and the length its block table covers (`--max-seq-len-to-capture`), or, run eagerly, B
and the block table's width in tokens. A replay that plans as the server did needs them: the
split counts come from that bound, not from the lengths.

The runner of rank 0 records from the host-side positions it already has (no device sync):
under pipelined speculation a verification's lengths count the previous step's drafts as
accepted (up to k more than the kernel reads). The file stops growing at `max_bytes` (one INFO
line says so), so a long-running server cannot fill its disk; a path that cannot be written
fails the start.
"""

import json
import logging
from pathlib import Path
from typing import NamedTuple

logger = logging.getLogger(__name__)
DEFAULT_MAX_BYTES = 64 << 20


class DecodeStep(NamedTuple):
    """One recorded decode step (the module docstring has the fields); plan_batch and plan_len
    are None in records written before they were kept."""

    q_len: int
    seq_lens: list[int]
    plan_batch: int | None = None
    plan_len: int | None = None


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

    def record(self, seq_lens: list[int], q_len: int, plan_batch: int, plan_len: int) -> None:
        """One decode step: each decoding request's length (this step's token included), and
        the batch size and length bound its plan was made for."""
        if self._file is None or not seq_lens:
            return
        step = {"q_len": q_len, "seq_lens": seq_lens, "plan_batch": plan_batch,
                "plan_len": plan_len}
        line = json.dumps(step, separators=(",", ":")) + "\n"
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


def read_decode_steps(path: str | Path) -> list[DecodeStep]:
    """The recorded steps; ValueError naming the line that is not one."""
    steps = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            fields = json.loads(line)
            step = DecodeStep(int(fields["q_len"]), [int(n) for n in fields["seq_lens"]],
                              *(None if fields.get(name) is None else int(fields[name])
                                for name in ("plan_batch", "plan_len")))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{path}:{number}: not a decode step ({line[:80]!r})") from None
        if step.q_len < 1 or not step.seq_lens or min(step.seq_lens) < 1:
            raise ValueError(f"{path}:{number}: q_len and every length must be >= 1")
        if (step.plan_batch is not None and step.plan_batch < len(step.seq_lens)) or (
                step.plan_len is not None and step.plan_len < max(step.seq_lens)):
            raise ValueError(f"{path}:{number}: the plan's batch and length must cover the step")
        steps.append(step)
    return steps

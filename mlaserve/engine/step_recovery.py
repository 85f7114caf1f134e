"""Re-running a failed step's requests apart (the engine core's fault isolation).

A step that fails is taken back (its tokens count as not computed, its requests leave the
runners' batch) and its requests run again in halves, each a step of its own, until the one
whose data breaks a step fails alone (`_rerun_apart`). `EngineCore` (core.py) inherits this;
it reads the core's scheduler, plan builder, runner, requests and lockstep, and its `_launch`,
`_apply` and `_finish`.
"""

import logging

from mlaserve.engine.messages import EngineCoreOutput
from mlaserve.engine.request import Request, RequestStatus
from mlaserve.engine.scheduler import ScheduledBatch
from mlaserve.engine.worker import ParallelEngineError

logger = logging.getLogger(__name__)


class StepRecovery:
    """The core's take-back and re-run of failed steps (module docstring)."""

    def _take_back(self, batch: ScheduledBatch) -> None:
        """Undo a failed step: its tokens count as not computed and its requests give their
        persistent-batch rows back (a failed launch may have half-written them)."""
        self.scheduler.retreat(batch)
        for request in batch.requests:
            self.plans.release(request.request_id)

    def _run_alone(self, batch: ScheduledBatch) -> list[EngineCoreOutput]:
        """Launch a step, wait for it and apply it; if it fails, take it back and re-raise."""
        try:
            pending = self._launch(batch)
            self.scheduler.advance(batch)
            result = self.runner.collect(pending)
        except Exception:
            self._take_back(batch)
            raise
        return self._apply(batch, result)

    def _rerun_apart(self, batch: ScheduledBatch, exc: Exception) -> list[EngineCoreOutput]:
        """Find which requests of a failed step fail it, by bisection; the others go on.

        The step's live requests run again in two halves, each as a step of its own that waits
        for its result; a half that fails again is split again. A request fails (with the error
        of the step that carried it alone) only when a step that carried it alone failed, so a
        fault that does not repeat fails no request, and a broken engine (every step fails)
        fails every request as before. KV slots that a failed step wrote are written again when
        its tokens are recomputed.
        """
        if self.lockstep is not None:  # the other replicas' exchanges cannot pair up again
            raise ParallelEngineError(
                f"a step of {len(batch.requests)} request(s) failed on this expert-parallel "
                f"replica ({type(exc).__name__}: {exc}); the replicas are out of step and the "
                "engine stops") from exc
        self._take_back(batch)
        live = [r for r in batch.requests if self._is_running(r)]
        if len(batch.requests) == 1:
            return self._fail(live, exc)
        if len(live) < len(batch.requests):
            parts = [live]  # some finished meanwhile: the rest may not fail without them
        else:
            parts = [live[: len(live) // 2], live[len(live) // 2 :]]
        outputs = []
        for part in parts:
            part = [r for r in part if self._is_running(r)]
            if not part:
                continue
            sub_batch = batch.subset(part)
            try:
                outputs += self._run_alone(sub_batch)
            except ParallelEngineError:
                raise
            except Exception as part_exc:  # noqa: BLE001 - narrowed down further
                outputs += self._rerun_apart(sub_batch, part_exc)
        return outputs

    def _is_running(self, request: Request) -> bool:
        return (self.requests.get(request.request_id) is request
                and request.status == RequestStatus.RUNNING)

    def _fail(self, requests: list[Request], exc: BaseException) -> list[EngineCoreOutput]:
        """Finish requests whose step failed with them alone, with the error."""
        outputs = []
        error = f"{type(exc).__name__}: {exc}"
        for request in requests:
            logger.error("request %s failed: %s", request.request_id, error)
            request.finish_reason = "abort"
            self._finish(request)
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="abort",
                                            error=error))
        return outputs

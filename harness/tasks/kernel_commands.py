"""What `kvfid kernels` and `kvfid compile` run: options checked (exit 2 / 3), then the library.

Bad names (dtypes, archs, kernels) are `BadInput` and a missing device `Unavailable` here, so the
command line maps one error hierarchy and nothing else.
"""

from __future__ import annotations

from kvfid.errors import BadInput
from kvfid import checks
from kvfid.environment import invariance
from kvfid.environment.compile import compile_targets
from kvfid.environment.compile_plan import plan
from kvfid.reports.invariance_table import write_result


def _split(text: str | None) -> tuple[str, ...] | None:
    return tuple(x for x in text.split(",") if x) if text else None


def kernel_verdicts(dtypes: str, device: str | None, quick: bool, threads: int, out=None,
                    progress=None, jobs: int = 1) -> tuple[dict, object]:
    """The batch-invariance and prefill-vs-decode verdicts (`invariance.compare_kernels`) and,
    with `out`, the file they were written to."""
    device = checks.device_and_threads(device, threads)
    try:
        result = invariance.compare_kernels(_split(dtypes) or (), device, quick, threads=threads,
                                            progress=progress, jobs=jobs)
    except ValueError as err:
        raise BadInput(str(err)) from None
    return result, (write_result(result, out) if out else None)


def compile_report(archs: str, dtypes: str, kernels: str | None, quick: bool, jobs: int | None,
                   out=None) -> dict:
    """Compile every planned kernel config for the archs and judge the cubins."""
    try:
        targets = plan(_split(archs), _split(dtypes), _split(kernels), quick)
    except ValueError as err:
        raise BadInput(str(err)) from None
    return compile_targets(targets, out, jobs)

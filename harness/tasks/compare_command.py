"""What `kvfid compare` runs: both ledgers resolved, the comparison, and its files when asked."""

from __future__ import annotations


def compare_command(a: str, b: str, db=None, db_a=None, db_b=None, out=None,
                    allow_different: bool = False, **inputs) -> tuple[dict, dict]:
    """Compare A with B (`kvfid.compare.runs.compare`; `inputs`: kernels_a/b, bench_a/b,
    threshold, reports); returns the result and {name: path} of the files written to `out`."""
    from kvfid.compare import runs as compare
    from kvfid.tasks.ledger_views import db_path

    result = compare.compare((db_path(db_a or db), db_path(db_b or db)), a, b,
                             allow_different=allow_different, **inputs)
    return result, (compare.write_comparison(result, out) if out else {})

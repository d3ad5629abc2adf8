"""Reports: run reports, figures, comparisons, the index, bench reports."""

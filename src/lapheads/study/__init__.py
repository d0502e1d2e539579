"""Studies over runs: analyze (geometry side by side), sweeps, reports with the verdict rule, the demo, mix heads."""

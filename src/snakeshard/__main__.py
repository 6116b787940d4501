"""``python -m snakeshard``: how the workflow's rules start every job. A job's line is parsed by job.py without
argparse (what a shard job imports: tests/test_job_overhead.py); any other command line goes to the CLI."""

import sys

from snakeshard.workflow.job import parse_job_args, run_command

job_args = parse_job_args(sys.argv[1:])
if job_args is None:
    from snakeshard.cli import main

    raise SystemExit(main())
raise SystemExit(run_command(job_args))

"""`python -m colo.grpo --steps N --json LOG --out CKPT_DIR [--resume] [--model PATH] [--trace FILE]`."""
import sys

from .cli import run_cli

sys.exit(run_cli(keep_logs_until_exit=True))

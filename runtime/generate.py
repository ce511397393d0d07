"""`python -m runtime.generate`: the decode CLI (flags in runtime.config.GenerateArguments, code in runtime/cli.py).

    python -m runtime.generate --model ../shared/models/smollm2-135m-instruct --method prompt_lookup \
        --prompt "Repeat after me: the quick brown fox jumps over the lazy dog." --max_new_tokens 64
"""

from heads.cli import run_cli
from runtime.cli import main

if __name__ == "__main__":
    run_cli(main)

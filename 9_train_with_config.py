r"""Stage 9: RIPT-CFG training configured from one typed YAML config (+ key=value overrides), validated at load.

Adds to stages 7/8: the config tree of pi0.ript.config (sections algo, task, env, distributed, features, logging),
bundled presets (pi0/ript/config/*.yaml), validation before any work (unknown key, wrong type, out-of-range value,
unknown task id, missing checkpoint -> one-line error, exit 2), the resolved config saved as
<out_dir>/<run_name>/config.yaml, and --resume from the run's latest checkpoint.

    .venv/bin/python 9_train_with_config.py --config_path train_pi0_cfg_rl algo.iterations=5
    .venv/bin/python 9_train_with_config.py --config_path my.yaml --resume
"""

from __future__ import annotations

from pi0.errors import run_cli
from pi0.ript.utils.train_loop import cli_main


def main(argv: list[str] | None = None) -> list[dict]:
    """Load + validate the config, train."""
    return cli_main(argv, "train_pi0_cfg_rl", __doc__)


if __name__ == "__main__":
    run_cli(main)

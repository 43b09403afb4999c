r"""Stage 9: the RIPT job from one typed YAML config (+ key=value overrides), without stage rules.

The config tree of pi0.ript.config (sections algo, task, env, distributed, features, logging), its loader and its
training loop (pi0.ript.utils.train_loop) are the ones stages 7 and 8 run on: validated at load (an unknown key,
wrong type, out-of-range value, unknown task id or missing checkpoint -> one-line error, exit 2), the resolved
config saved as <out_dir>/<run_name>/config.yaml, --resume from the run's latest checkpoint. Stages 7 and 8 keep
within their rules (stage 7: no smart sampling, one update pass); stage 9 adds the general entry point: any bundled
preset (pi0/ript/config/*.yaml) or YAML file with any combination of the feature flags (parallel envs, the
RIPT-VLA runner, videos, LR warm-up, resumable checkpoints); default preset train_pi0_cfg_rl (a longer arena run
with the CFG objective; algo.objective=ppo for LOOP).

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

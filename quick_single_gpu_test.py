r"""System check before a long run: validates the setup a preset describes and prints a pass/fail report with the
fix for each failure (imports, EGL/OSMesa rendering, LIBERO assets + init states, checkpoint + norm stats +
tokenizer, devices and free memory vs ~2 GB per LIBERO env, one short rollout and one update).

    .venv/bin/python quick_single_gpu_test.py --config_path single_gpu_test task.checkpoint=ckpts/pi0_libero
    .venv/bin/python quick_single_gpu_test.py --config_path debug_train_pi0      # arena, CPU

Exit status: 0 all checks pass, 1 a check failed, 2 the config itself is invalid.
"""

from __future__ import annotations

import argparse

from pi0.errors import run_cli
from pi0.ript.config import load_config
from pi0.ript.utils.system_check import run_checks


def main(argv: list[str] | None = None) -> int:
    """Load the config (without requiring the checkpoint to exist: that is a check), run the checks, report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_path", default="single_gpu_test", help="YAML file or bundled preset name")
    p.add_argument("--skip_rollout", action="store_true", help="skip the rollout + update check")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    args = p.parse_args(argv)
    cfg = load_config(args.config_path, args.overrides, check_paths=False)
    checks = run_checks(cfg, args.skip_rollout)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"[{'PASS' if c.ok else 'FAIL'}] {c.name:<{width}}  {c.detail}")
        if not c.ok and c.fix:
            print(f"       {'':<{width}}  fix: {c.fix}")
    bad = sum(not c.ok for c in checks)
    print(f"{len(checks) - bad}/{len(checks)} checks passed" + ("" if not bad else f"; {bad} failed"))
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(run_cli(main))

"""Run the devnet `make demo` runs (`p2pnet devnet` with its defaults) and, once the trainer is
done and every peer still runs, screenshot its dashboard in headless Chromium.

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/img/dashboard.png] [--steps 30]

Needs a Chromium (Debian package chromium). The README shows the result.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.devnet import DevnetConfig, run_devnet  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    parser.add_argument("--steps", type=int, default=DevnetConfig().steps)
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        print("no headless browser: install Debian's chromium", file=sys.stderr)
        return 2
    shot: dict[str, subprocess.CompletedProcess] = {}

    def observe(procs) -> None:
        if shot or not procs["trainer"].status()["role_status"]["trainer"]["done"]:
            return
        url = procs["trainer"].status()["metrics_url"] + "/"
        shot["run"] = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                      "--window-size=1400,1500", "--virtual-time-budget=5000",
                                      f"--screenshot={args.out.resolve()}", url],
                                     capture_output=True, text=True, timeout=120)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="p2pnet-screenshot-") as tmp:
        run_devnet(DevnetConfig(steps=args.steps), Path(tmp), plot_to=Path(tmp) / "reward.png", observe=observe)
    if "run" not in shot or shot["run"].returncode != 0:
        print(f"no screenshot: {shot['run'].stderr[-2000:] if shot else 'the trainer never finished'}", file=sys.stderr)
        return 1
    print(f"dashboard screenshot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

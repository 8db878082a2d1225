"""What `p2pnet sim run` prints: the main metric and, for a broadcast, how far it is from the bound."""

import re
import subprocess
import sys


def test_a_broadcast_run_prints_its_ratio_to_the_lower_bound(tmp_path):
    out = subprocess.run([sys.executable, "-m", "p2pnet", "sim", "run", "broadcast", "--peers", "5", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^  \d+\.\d\dx the lower bound \(\d+\.\d+ s", out.stdout, re.M), out.stdout

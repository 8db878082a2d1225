"""The configuration reference cannot drift from the code, and `p2pnet config init/show` give
a user a file they can edit and the values a peer would run with."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

from p2pnet.settings import SECTIONS, render_init, render_reference, settings, undocumented

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "p2pnet", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, env=env)


def test_docs_configuration_md_is_what_the_config_classes_say():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render_reference(), (
        "docs/configuration.md differs from the config classes: regenerate it with "
        "`python -m p2pnet.settings > docs/configuration.md`")


def test_every_key_of_every_section_is_described():
    assert undocumented() == []
    reference = render_reference()
    for section in ("peer", "peertable", "relay", "worker", "validator", "trainer"):
        assert f"## [{section}]" in reference
        for s in settings(section):
            assert f"| `{s.name}` |" in reference


def test_the_init_file_sets_nothing_until_a_line_is_uncommented():
    text = render_init()
    assert tomllib.loads(text) == {}
    for section in SECTIONS:
        assert f"# [{section}]" in text
    edited = text.replace("# [peertable]", "[peertable]").replace("# heartbeat_interval_s = 2.0",
                                                                  "heartbeat_interval_s = 0.5")
    assert tomllib.loads(edited) == {"peertable": {"heartbeat_interval_s": 0.5}}


def test_config_init_then_show(tmp_path):
    data = tmp_path / "p"
    out = run_cli("config", "init", "--data-dir", str(data))
    assert out.returncode == 0 and (data / "config.toml").is_file()
    again = run_cli("config", "init", "--data-dir", str(data))
    assert again.returncode == 2 and "--force" in again.stderr
    text = (data / "config.toml").read_text().replace("# [relay]", "[relay]").replace(
        "# keep_versions = 3", "keep_versions = 5")
    (data / "config.toml").write_text(text)
    shown = run_cli("config", "show", "--data-dir", str(data))
    assert shown.returncode == 0, shown.stderr
    values = tomllib.loads(shown.stdout)
    assert values["relay"]["keep_versions"] == 5 and values["peertable"]["heartbeat_interval_s"] == 2.0
    assert values["peer"]["data_dir"] == str(data)
    assert "model_dir: not set (required when the worker role runs)" in shown.stdout
    as_json = json.loads(run_cli("config", "show", "--data-dir", str(data), "--json").stdout)
    assert as_json["file"] == str(data / "config.toml")
    assert as_json["sections"]["relay"] == values["relay"]


def test_config_show_checks_what_a_peer_start_checks(tmp_path):
    data = tmp_path / "p"
    data.mkdir()
    (data / "config.toml").write_text("[validator]\nsample_rate = 2.0\n")
    out = run_cli("config", "show", "--data-dir", str(data))
    assert out.returncode == 2 and "validator.sample_rate" in out.stderr and "Traceback" not in out.stderr


def test_the_default_data_dir_is_p2pnet_home(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "P2PNET_HOME": str(tmp_path / "elsewhere")}
    shown = json.loads(run_cli("config", "show", "--json", env=env).stdout)
    assert shown["sections"]["peer"]["data_dir"] == str(tmp_path / "elsewhere")
    del env["P2PNET_HOME"]
    assert run_cli("peer", "id", env=env).returncode == 0
    assert (tmp_path / "home" / ".p2pnet" / "identity.key").is_file()

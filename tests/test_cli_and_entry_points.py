import json

from .conftest import run_cli


def test_info_json_lists_platforms_and_current():
    out = run_cli("info", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    names = {p["name"] for p in info["platforms"]}
    assert {"cpu", "cuda", "rocm", "xpu", "npu", "musa"} <= names
    assert info["current"]["name"] == "cpu"
    assert info["current"]["devices"][0]["memory"]["total"] > 0


def test_bad_platform_env_exits_nonzero_naming_known_platforms():
    out = run_cli("info", env={"TORCHHAL_PLATFORM": "nope"})
    assert out.returncode == 2
    assert "unknown platform 'nope'" in out.stderr
    assert "cpu, cuda, musa, npu, rocm, xpu" in out.stderr


def test_entry_point_plugin_is_loaded_with_its_distribution():
    out = run_cli("info", "--json", with_test_dist=True, env={"TORCHHAL_TESTPLUGIN_MODE": "ok"})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    entry = {p["name"]: p for p in info["platforms"]}["testaccel"]
    assert entry["distribution"] == "torchhal-testplugin" and entry["version"] == "0.3"
    assert info["current"]["name"] == "testaccel"  # priority 5 beats cpu's 0


def test_raising_detection_shows_in_info_while_cpu_is_selected():
    out = run_cli("info", with_test_dist=True, env={"TORCHHAL_TESTPLUGIN_MODE": "raise"})
    assert out.returncode == 0, out.stderr
    assert "Current platform: cpu" in out.stdout
    assert "testaccel (torchhal-testplugin): failed to detect: RuntimeError: testaccel driver crashed" in out.stdout


def test_plugin_that_fails_to_import_is_reported():
    out = run_cli("info", "--json", with_test_dist=True, env={"TORCHHAL_TESTPLUGIN_MODE": "import"})
    assert out.returncode == 0, out.stderr
    errors = json.loads(out.stdout)["plugin_errors"]
    assert errors[0]["plugin"] == "testaccel" and errors[0]["stage"] == "import"
    assert "libtestaccel.so" in errors[0]["error"]
    assert "TorchhalPluginWarning" in out.stderr


def test_allow_list_empty_string_loads_no_third_party_plugins():
    out = run_cli("info", "--json", with_test_dist=True, env={"TORCHHAL_TESTPLUGIN_MODE": "ok", "TORCHHAL_PLUGINS": ""})
    info = json.loads(out.stdout)
    assert "testaccel" not in {p["name"] for p in info["platforms"]}
    assert info["current"]["name"] == "cpu"


def test_allow_list_names_the_plugin_and_reports_missing_ones():
    out = run_cli(
        "info", "--json", with_test_dist=True,
        env={"TORCHHAL_TESTPLUGIN_MODE": "ok", "TORCHHAL_PLUGINS": "testaccel,ghost"},
    )
    info = json.loads(out.stdout)
    assert "testaccel" in {p["name"] for p in info["platforms"]}
    assert any(e["plugin"] == "ghost" and "no installed distribution" in e["error"] for e in info["plugin_errors"])

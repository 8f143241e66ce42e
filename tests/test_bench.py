"""The benchmark script itself, on its CPU subset: real runs, real figures."""
import json

from conftest import script


def test_compare_cpu_subset_measures_both_systems_and_writes_its_files(tmp_path):
    out = script("bench/compare.py", "--cpu", "--out", tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "compare_cpu.json").read_text())
    assert result["complete"] is True and result["command"].startswith("python bench/compare.py")
    systems = {f["system"]: f for f in result["figures"]}
    assert set(systems) == {"one CPU process (mlp.py)", "demo cpu cpu"}
    for f in systems.values():
        assert f["samples_per_s"] > 0 and f["steps"] >= 12 and f["batch"] == 500
        assert 0 < f["validation_error"] < 0.9  # it trained: chance is 0.9
    assert (tmp_path / "compare_cpu.png").stat().st_size > 10000
    assert "| demo cpu cpu | 2 |" in out.stdout


def test_compare_stops_at_a_failing_run_without_figures(tmp_path):
    out = script("bench/compare.py", "--cpu", "--out", tmp_path, "--dataset", tmp_path / "none")
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [f"compare.py: error: {tmp_path / 'none'}: cannot "
                                               "read: No such file or directory"]
    assert not (tmp_path / "compare_cpu.json").exists()

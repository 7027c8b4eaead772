"""`make test`'s scheduling units (tests/helpers/suite_scopes.py): every module that may start Ray shares one
unit, so no two Ray clusters run at once; any other module is its own unit."""

from __future__ import annotations

from pathlib import Path

from suite_scopes import RAY_SCOPE, scope_of, uses_ray

ROOT = Path(__file__).resolve().parents[1]


def test_ray_modules_share_one_unit_and_others_keep_their_own():
    ray_ids = [
        "tests/distributed/test_ray_cluster.py::test_rl_on_a_two_node_cluster_started_with_ray_start",
        "tests/examples/test_slurm_launch.py::test_two_ray_nodes_on_this_host_run_a_command_and_stop",
        "tests/distributed/test_four_ranks.py::test_sft_on_four_ranks_equals_one_rank_and_resumes_on_one",
    ]
    assert {scope_of(i, ROOT) for i in ray_ids} == {RAY_SCOPE}
    plain = "tests/algorithms/test_advantages.py::test_x"
    assert scope_of(plain, ROOT) == "tests/algorithms/test_advantages.py"


def test_every_module_that_starts_ray_is_in_the_ray_unit():
    """Whatever starts Ray in a test (ray.init, `ray start`, a launcher or a command in Ray mode) names it."""
    starts = ("ray.init(", '"ray", "start"', "RayLauncher(", 'mode="ray"', "--dist.mode", "ray_cluster")
    starts += ("rl_cfg(", "one_and_two_ranks(")  # tests/helpers/dp_fixtures.py: Ray mode beyond one rank
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        if any(s in text for s in starts):
            assert uses_ray(path), path


def test_the_word_is_matched_whole_and_in_any_case(tmp_path):
    for text, want in (("import ray\n", True), ('"""A Ray run."""\n', True), ("array = 1\n", False)):
        module = tmp_path / f"m{len(text)}{want}.py"
        module.write_text(text)
        assert uses_ray(module) is want

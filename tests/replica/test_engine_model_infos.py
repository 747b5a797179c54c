"""The one cache a host's engines share (replica/agent/engine_process.py `share_model_infos`):
vLLM's model-class record, ``VLLM_CACHE_ROOT/modelinfos`` of each engine, is the host's
directory, created private; every other cache stays under the engine's own work dir."""

from __future__ import annotations

from pathlib import Path

from replica.agent.engine_process import EngineProcess, share_model_infos


def test_each_engines_record_is_the_hosts_directory_and_the_rest_stays_its_own(tmp_path: Path) -> None:
    shared = tmp_path / "home" / "engine-cache" / "modelinfos"
    engines = [EngineProcess(tmp_path / "model", work_dir=tmp_path / name, model_info_cache=shared) for name in "ab"]
    for e in engines:
        share_model_infos(shared, Path(e.environment()["VLLM_CACHE_ROOT"]) / "modelinfos")
    (shared / "vllm-model-LlamaForCausalLM.json").write_text("{}")
    for e in engines:
        root = Path(e.environment()["VLLM_CACHE_ROOT"])
        assert root.is_relative_to(e.work_dir)
        assert (root / "modelinfos").resolve() == shared.resolve()
        assert (root / "modelinfos" / "vllm-model-LlamaForCausalLM.json").exists()
    assert shared.stat().st_mode & 0o777 == 0o700


def test_a_stale_directory_in_its_place_is_replaced_and_the_link_is_kept(tmp_path: Path) -> None:
    shared, link = tmp_path / "shared", tmp_path / "work" / "cache" / "vllm" / "modelinfos"
    link.mkdir(parents=True)
    (link / "old.json").write_text("{}")
    share_model_infos(shared, link)
    assert link.is_symlink() and link.resolve() == shared.resolve()
    share_model_infos(shared, link)  # a restart of the same engine
    assert link.is_symlink()


def test_without_one_nothing_is_shared(tmp_path: Path) -> None:
    e = EngineProcess(tmp_path / "model", work_dir=tmp_path / "w")
    assert e.model_info_cache is None

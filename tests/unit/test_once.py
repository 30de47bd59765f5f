"""A decision said once per process, from any number of threads at once (jaxtrain.runtime.once)."""
import threading

from jaxtrain.runtime import once


def test_only_the_first_of_many_threads_adding_an_item_is_told_so():
    for _ in range(50):
        seen, firsts, gate = set(), [], threading.Barrier(8)

        def add():
            gate.wait()
            firsts.append(once.first(seen, ("cpu_fused", "backend cpu")))

        threads = [threading.Thread(target=add) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(firsts) == [False] * 7 + [True] and seen == {("cpu_fused", "backend cpu")}
    assert once.first(seen, ("xla", "another reason")) and not once.first(seen, ("xla", "another reason"))


def test_a_runs_decisions_are_kept_for_its_run_directory_and_merged_from_a_loaded_program():
    once.forget()
    seen: set = set()
    assert once.decided(seen, "model.matmul", "cpu_fused", "small") and not once.decided(seen, "model.matmul",
                                                                                          "cpu_fused", "small")
    assert not once.decided({("xla", "large")}, "model.matmul", "xla", "large")  # logged before; still kept
    once.decided(seen, "model.matmul", "xla", "larger")  # one choice, another reason: both kept
    once.merge({"model.attention": {"cpu_fused": ["backend cpu"]}, "model.matmul": {"xla": ["large"]},
                "bad": ["not", "a", "dict"], 3: {"x": ["y"]}, "also bad": {"x": "not a list"}})
    assert once.decisions() == {"model.matmul": {"cpu_fused": ["small"], "xla": ["large", "larger"]},
                                "model.attention": {"cpu_fused": ["backend cpu"]}}
    once.forget()
    assert once.decisions() == {}


def test_a_line_is_said_once_whichever_path_says_it_first(caplog):
    """A warm start that loaded one program from the cache and traced another printed each auto line twice:
    once from the tracing, once as the loaded program's stored line (seen by a new user)."""
    import logging

    from jaxtrain.train import program_cache
    line = "model.matmul=auto -> xla (cpu_fused: a reason)"
    log = logging.getLogger("jaxtrain")
    with caplog.at_level(logging.INFO, logger="jaxtrain"):
        assert once.say(log, logging.INFO, line) and not once.say(log, logging.INFO, line)
        program_cache._say([[logging.INFO, line], [logging.INFO, "a stored line"]])  # a loaded program's
        program_cache._say([[logging.INFO, "a stored line"]])
        once.mark_said(["traced elsewhere"])
        program_cache._say([[logging.INFO, "traced elsewhere"]])
    assert [r.getMessage() for r in caplog.records] == [line, "a stored line"]

"""Text generation from Python with the embedded model (models/kiln-tiny): the pipeline gives the text
`kiln generate` gives, the batching engine runs many requests at once without changing any of them,
and Ctrl-C interrupts a long generation."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import SOURCE_DIR
from kiln.pipelines import GenerationEngine, TextGenerationPipeline

MODEL = str(SOURCE_DIR / "models" / "kiln-tiny")
KILN_BIN = os.environ.get("KILN_BIN")


@pytest.fixture(scope="module")
def pipeline():
    return TextGenerationPipeline(MODEL)


@pytest.mark.skipif(not KILN_BIN, reason="KILN_BIN: the kiln command (ctest sets it)")
def test_greedy_text_is_what_kiln_generate_prints(pipeline):
    pieces = []
    result = pipeline.generate("Once upon a time", max_new_tokens=24, temperature=0, on_text=pieces.append)
    cli = subprocess.run([KILN_BIN, "generate", "--prompt", "Once upon a time", "--temperature", "0",
                          "--max-new-tokens", "24"], capture_output=True, text=True, check=True)
    assert result.text and cli.stdout.rstrip("\n") == result.text
    assert "".join(pieces) == result.text and len(result.token_ids) == 24


def test_bad_sampling_is_a_value_error_naming_the_field(pipeline):
    with pytest.raises(ValueError, match="top_p"):
        pipeline.generate("Hi", top_p=0)


def test_the_batching_engine_runs_requests_together_without_changing_them():
    engine = GenerationEngine(MODEL)
    prompts = ["Once upon a time", "You will", "Love is"]
    together = engine.generate(prompts, temperature=0.8, seed=7, max_new_tokens=20)
    alone = [engine.generate(p, temperature=0.8, seed=7, max_new_tokens=20) for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.text for o in together] == [o.text for o in alone]
    assert all(len(o.token_ids) >= 1 for o in together)
    assert engine.stats().steps > 0
    ids = engine.encode("You will")
    assert engine.generate(ids, temperature=0.8, seed=7, max_new_tokens=20).token_ids == alone[1].token_ids


def test_ctrl_c_interrupts_a_long_generation(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from kiln.pipelines import GenerationEngine
        engine = GenerationEngine({MODEL!r}, num_threads=1)
        prompts = ["Once upon a time %d" % i for i in range(64)]
        print("started", flush=True)
        try:
            for _ in range(10):   # about 30 s of work on one thread
                engine.generate(prompts, temperature=0.8, seed=1, max_new_tokens=10000, ignore_eos=True)
            print("finished", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            time.sleep(0.5)       # the cancelled requests leave at the engine's next step
            stats = engine.stats()
            print(f"running={{stats.running}} waiting={{stats.waiting}}", flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ)
    assert child.stdout.readline().strip() == "started"
    time.sleep(1.0)                          # into the first batch
    sent = time.perf_counter()
    child.send_signal(signal.SIGINT)
    first = child.stdout.readline().strip()
    waited = time.perf_counter() - sent
    rest, _ = child.communicate(timeout=60)
    assert first == "interrupted", first + rest
    assert waited < 10, waited               # soon after the signal (3.3 s once under a loaded ctest), not after the 30 s of work
    assert rest.split() == ["running=0", "waiting=0"], rest

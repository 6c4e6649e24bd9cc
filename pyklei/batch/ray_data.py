"""A batch job's requests on Ray Data: an actor pool of pyklei engines, each actor one engine
(engine_run.EngineRunner over it), results back in the input's order.

    ray = connect(address, part="data", num_cpus=...)    # pyklei.distributed.ray_connect
    results = lambda todo: run_on_ray(ray, todo, model="smollm2.gguf", replicas=2, threads=1,
                                      n_parallel=4, load_kwargs={...}, model_id="smollm2",
                                      created=created_of(input))
    run_job(input, output, results)                      # job.py: the same resume and writing

The lines travel as their number and text, and each actor parses them with the same
lines.parse_line, runs them with the same EngineRunner, and encodes them with the same
lines.encode as a local run: for greedy requests the output is the local run's, byte for byte.
Each actor asks Ray for `threads` CPUs; the model file must be readable at the same path on
every node that runs one.
"""
from __future__ import annotations

import logging

import numpy as np

from . import lines as L
from .engine_run import EngineRunner, load_engine


class EngineActor:
    """One pyklei engine in a Ray actor: map_batches' callable class."""

    def __init__(self, model: str, n_parallel: int, load_kwargs: dict, model_id: str, created: int):
        self.llm, self.engine = load_engine(model, n_parallel, **load_kwargs)
        self.runner = EngineRunner(self.engine, self.llm.tokenizer, model_id, created)

    def __call__(self, batch: dict) -> dict:
        todo = [L.parse_line(int(n), str(raw)) for n, raw in zip(batch["number"], batch["raw"])]
        outs = [data.decode("utf-8") for data in self.runner.run(todo)]
        return {"number": np.asarray(batch["number"]), "out": np.array(outs, dtype=object)}


def run_on_ray(ray, todo: list, *, model: str, replicas: int, threads: int, n_parallel: int,
               load_kwargs: dict, model_id: str, created: int, batch_size: int | None = None):
    """The encoded output lines of `todo` (BatchLines), in their order, run by `replicas`
    EngineActors of `threads` CPUs each (a generator: results come as Ray finishes them)."""
    if not todo:
        return
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True       # results in the order of the input
    ctx.enable_progress_bars = False                  # the job has its own (the CLI's)
    logging.getLogger("ray.data").setLevel(logging.ERROR)     # failures are raised, not logged
    ds = ray.data.from_items([{"number": line.number, "raw": line.raw} for line in todo])
    kw = dict(load_kwargs, n_threads=threads)
    # an actor that dies is restarted by Ray Data and its batch run again: results reach the
    # file only from here, in order, so a batch run twice is still written once
    ds = ds.map_batches(EngineActor, compute=ray.data.ActorPoolStrategy(size=replicas),
                        num_cpus=threads,
                        batch_size=batch_size or max(4 * n_parallel, 8),
                        fn_constructor_kwargs=dict(model=model, n_parallel=n_parallel,
                                                   load_kwargs=kw, model_id=model_id,
                                                   created=created))
    # preserve_order keeps the order; the buffer makes it a checked fact, not an assumption
    order = {line.number: i for i, line in enumerate(todo)}
    held: dict[int, bytes] = {}
    nxt = 0
    for row in ds.iter_rows():
        held[order[int(row["number"])]] = row["out"].encode("utf-8")
        while nxt in held:
            yield held.pop(nxt)
            nxt += 1
    if nxt != len(todo):
        raise RuntimeError(f"Ray Data returned {nxt} of {len(todo)} results")

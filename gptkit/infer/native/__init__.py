"""The native decoding step: one token of one sequence, or of several, on the CPU in a single C++ call.

Why: at batch 1 a step reads every weight once, so its floor is the weight bytes over the memory's read speed. The
compiled step (gptkit.infer.compiled) runs some 150 kernels a token, each its own parallel region, behind dynamo's
and inductor's wrappers; the native step runs the whole pass in one parallel region whose threads meet at barriers,
reading the weights from one buffer in the order the pass reads them. `python benchmarks/bench.py sample
--paths=native --paths=native_bf16 --paths=native_int8` measures it against the memory bound; docs/benchmarks.md has
the figures.

- gptkit.infer.native.step: NativeStep (the packed weights of a model and the calls into the C++), native_problem
  (which models it serves) and NativeBackend (the engine's backend that runs every step with it).
- gptkit.infer.native.packing: the weights packed in the layout the C++ reads.
- gptkit.infer.native.build: building the C++ for this CPU and loading the build (a test patches it there).
- csrc/: the C++: decode_step.cpp, the step's entry points on plain buffers (entry.h), which includes a file for each
  concern: vector lanes, the products of each kind of weights, norms and activations, sampling, the packed layout,
  attention, and the step itself; and bindings.cpp, the Python entry points, which hands them tensors.

`python -m gptkit.infer.native --build` builds it (the set-up runs it).
"""

from gptkit.infer.memory import huge_page_zeros
from gptkit.infer.native.build import build_directory, build_problem, builder_lock, extension, is_built
from gptkit.infer.native.packing import weights_name
from gptkit.infer.native.step import OTHER_PATHS, PACKED_STEPS, NativeBackend, NativeStep, native_problem

__all__ = [
    "OTHER_PATHS",
    "PACKED_STEPS",
    "NativeBackend",
    "NativeStep",
    "build_directory",
    "build_problem",
    "builder_lock",
    "extension",
    "huge_page_zeros",
    "is_built",
    "native_problem",
    "weights_name",
]

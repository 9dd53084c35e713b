"""Every Triton kernel launch the interpreter ran, compiled for the H200 (sm_90) on the CPU.

Triton's interpreter runs a kernel as Python, so it accepts code the compiler refuses (a name rebound to another
type in a branch), and such a kernel first failed on a lent GPU. conftest records each distinct launch (the
kernel, its arguments' types, its constexprs); at the session's end `python tests/sm90.py launches.jsonl` compiles
each, without the interpreter, to a cubin (Triton's own ptxas, no driver needed), and names those that fail.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys

import torch

LAUNCH_OPTIONS = ("num_warps", "num_stages")
POINTEE = {torch.bool: "i1", torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16",
           torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
           torch.uint8: "u8"}  # fmt: skip


def _type(value) -> str:
    """Triton's signature type of a runtime argument."""
    if isinstance(value, torch.Tensor):
        return "*" + POINTEE[value.dtype]
    if type(value).__name__ == "TensorDescriptor":  # a host-built TMA descriptor (triton.tools.tensor_descriptor)
        return f"tensordesc<{POINTEE[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no signature type for {type(value).__name__}")


def _constant(value):
    """A constexpr as JSON: tl dtypes by name."""
    return {"dtype": value.name} if type(value).__name__ == "dtype" else value


def launch_key(fn, args: tuple, kwargs: dict) -> str:
    """One launch of the interpreted kernel `fn` (its Python function) as a JSON line; the same key for launches
    the compiler would see as one kernel."""
    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    signature_of_fn = inspect.signature(fn)
    bound = signature_of_fn.bind(*args, **kwargs)
    bound.apply_defaults()
    params = signature_of_fn.parameters
    signature, constants = {}, {}
    for name, value in bound.arguments.items():
        if "constexpr" in str(params[name].annotation) or value is None:
            signature[name], constants[name] = "constexpr", _constant(value)
        else:
            signature[name] = _type(value)
    key = dict(module=fn.__module__, name=fn.__name__, signature=signature, constants=constants, options=options)
    return json.dumps(key, sort_keys=True)


def compile_one(launch: dict) -> str | None:
    """None, or why the launch does not compile for sm_90."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    constants = {k: tl.dtype(v["dtype"]) if isinstance(v, dict) else v for k, v in launch["constants"].items()}
    # the interpreter's in-order dot stands in for tl.dot, which the GPU runs (invariant.dot.precision)
    first_pointer = next(t for t in launch["signature"].values() if t.startswith("*"))
    gpu_precision = "ieee" if first_pointer == "*fp32" else "tf32"
    constants = {k: gpu_precision if v == "in_order" else v for k, v in constants.items()}
    try:
        source = ASTSource(kernel, signature=launch["signature"], constexprs=constants)
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as e:  # the compiler's message is the finding
        return f"{launch['module']}.{launch['name']} {launch['constants']}: {str(e)[-1500:]}"
    return None


def gpu_variants(launch: dict) -> list[dict]:
    """The launch, and where the kernel takes programmatic dependent launch (layers.pdl; the interpreter runs PDL=False)
    the form the GPU runs too: PDL=True, launched with launch_pdl; where it takes an L2 prefetch (layers.prefetch;
    the interpreter runs PREFETCH=False), with PDL and the prefetch as well."""
    constants = launch.get("constants", {})
    if constants.get("PDL") is not False:
        return [launch]
    pdl = dict(launch, constants=dict(constants, PDL=True), options=dict(launch["options"], launch_pdl=True))
    prefetching = dict(pdl, constants=dict(pdl["constants"], PREFETCH=True))
    return [launch, pdl] + ([prefetching] if constants.get("PREFETCH") is False else [])


def main(path: str) -> int:
    with open(path) as f:
        launches = [json.loads(line) for line in f]
    # a launch conftest could not describe is a failure too: the check must not skip what it cannot read
    launches = [variant for launch in launches for variant in gpu_variants(launch)]
    failures = [launch["unrecorded"] if "unrecorded" in launch else compile_one(launch) for launch in launches]
    failures = [why for why in failures if why]
    print(f"sm_90 compile: {len(launches)} distinct Triton launches, {len(failures)} failed")
    for why in failures:
        print(why)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

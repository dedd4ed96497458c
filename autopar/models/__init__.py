"""Model zoo: GPT and Llama presets, spec strings and user factories.

`resolve(name)` turns what a user types (`llama3-8b`, `gpt:layers=2,hidden=64,...`,
`pkg.mod:make`) into a `ModelSource` the tracer and runtime can build from.
"""

from autopar.models.zoo import PRESETS, ModelSource, parse_spec, resolve

__all__ = ["PRESETS", "ModelSource", "parse_spec", "resolve"]

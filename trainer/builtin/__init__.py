"""The models the project builds itself, offline: the tiny Llama and its warm start, the test architectures'
small decoders, and SmolLM2-135M from a wheel; ``builtin:...`` names checked and resolved to directories."""

"""The compute engine: GGUF layer ranges run with tinygrad (see NOTES.md, "Engine")."""
import os

# tinygrad's HCQ2 runtime replays a captured step as one command buffer that a worker thread runs in C, instead
# of a Python call per kernel: ~8 us per kernel launch against ~38 us, which halves a SmolLM2 decode step on CPU
# now that the matvecs are fast (NOTES, "Engine"). tinygrad reads the flag when it is first imported, so it is
# set here, before any engine module imports tinygrad; it only changes the CPU and AMD runtimes. HCQ2=0 opts out.
os.environ.setdefault("HCQ2", "1")

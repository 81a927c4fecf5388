"""The compute engine: GGUF layer ranges run with tinygrad (see NOTES.md, "Engine")."""

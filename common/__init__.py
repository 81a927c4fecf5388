"""Leaf modules every package may import (standard library only): see NOTES "Layout and dependency direction"."""

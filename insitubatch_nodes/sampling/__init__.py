"""sampling: see DESIGN.md "Modules"."""

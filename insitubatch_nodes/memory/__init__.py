"""memory: see DESIGN.md "Modules"."""

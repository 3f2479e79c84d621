"""store: see DESIGN.md "Modules"."""

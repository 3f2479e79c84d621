"""state: see DESIGN.md "Modules"."""

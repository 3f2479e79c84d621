"""metrics: see DESIGN.md "Modules"."""

"""fetch: see DESIGN.md "Modules"."""

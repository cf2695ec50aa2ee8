"""One package per model family, each named in `models.registry.ARCHITECTURES`. A family imports the
shared blocks of `models/` and never another family; generic code reaches a family only through the
registry. Both rules are import-linter contracts over `vlm_engine.models.families.*`, so a new family
joins them by being a package here."""

"""One file per architecture family; `registry` maps a checkpoint's config to its class."""

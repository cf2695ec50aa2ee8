"""Forward passes: input building, attention backends, sampling."""

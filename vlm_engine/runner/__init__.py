"""Forward passes: input building, media merge, sampling (attention lives in vlm_engine.attention)."""

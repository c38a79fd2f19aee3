"""Provider prompt-caching models and cost: prices are data (presets/*.yaml) with a source and a date."""

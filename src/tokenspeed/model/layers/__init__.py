"""Model layers: modules holding weights and calling the ops in `tokenspeed.model.ops`."""

"""Pure tensor math: no modules, no configs. Convention everywhere: x ~= q * scale."""

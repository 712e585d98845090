"""How things run fast, apart from what the mechanisms compute: attention's implementations
(`attention`), AttnRes's depth reads and block scan (`depth_read`, `block_scan`) and mHC's
Sinkhorn projection (`sinkhorn`)."""

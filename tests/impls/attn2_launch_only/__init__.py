"""An implementation whose cute_ops has attn2's launch and compile but not the split plan and the
workspace size a runner sizes the launch with: a job must refuse it before anything launches."""

"""The doctor's checks, in the order the table shows them: from where a divergence starts (inside the model; for a
mixture-of-experts model, which experts each side chose; for a vision-language model, its images and vision tower) to
what surrounds the model (the decode path, batching, caching, the weight sync, tokens, sampling) and the precision
recipes side by side."""
from trainer.doctor.checks.batch_invariance import CHECK as BATCH_INVARIANCE
from trainer.doctor.checks.images import CHECK as IMAGES
from trainer.doctor.checks.layers import CHECK as LAYERS
from trainer.doctor.checks.prefill_decode import CHECK as PREFILL_DECODE
from trainer.doctor.checks.prefix_cache import CHECK as PREFIX_CACHE
from trainer.doctor.checks.recipes import CHECK as RECIPES
from trainer.doctor.checks.routing import CHECK as ROUTING
from trainer.doctor.checks.sampling import CHECK as SAMPLING
from trainer.doctor.checks.tokens import CHECK as TOKENS
from trainer.doctor.checks.weight_sync import CHECK as WEIGHT_SYNC

CHECKS = (LAYERS, ROUTING, IMAGES, PREFILL_DECODE, BATCH_INVARIANCE, PREFIX_CACHE, WEIGHT_SYNC, TOKENS, SAMPLING, RECIPES)

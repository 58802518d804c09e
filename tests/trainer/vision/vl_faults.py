"""The input faults the vision-language tests plant, each undone by the function it returns: the trainer's processor
resizing to other pixels than the engine's, and the engine's request for one prompt sent without its image. Shared by
the training worker (vl_runs_worker.py) and the doctor's (vl_doctor_worker.py), which run them in processes of their
own."""
from rollout.vllm_engine import VLLMEngine
from trainer.vision.prompts import VisionPrompts


def processor_at_42_pixels():
    """The trainer's processor resizing to 42 pixels where the engine's resizes to 56."""
    real = VisionPrompts.__init__

    def init(self, processor, *args, **kwargs):
        processor.image_processor.size = processor.image_processor.max_image_size = {"longest_edge": 42}
        real(self, processor, *args, **kwargs)

    VisionPrompts.__init__ = init
    return lambda: setattr(VisionPrompts, "__init__", real)


def engine_drops_an_image():
    """The engine's request for the batch's second prompt without its image (its placeholder stays, as text)."""
    real = VLLMEngine.generate

    def generate(self, prompt_ids, spec, images=None):
        if images is not None and len(images) > 1:
            images = [im if i != 1 else [] for i, im in enumerate(images)]
        return real(self, prompt_ids, spec, images=images)

    VLLMEngine.generate = generate
    return lambda: setattr(VLLMEngine, "generate", real)

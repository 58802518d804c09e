"""Vision-language policies: the images of a batch, laid out for the trainer's forward, and the image features merged
into the decoder's input at the prompt's placeholder positions."""

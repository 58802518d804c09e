"""The shapes task's images: deterministic, the count the pixels show, the two splits apart."""
import pytest

from trainer.data.tasks.shapes import COLOURS, IMAGE_SIZE, draw_shapes, shapes_answer, shapes_example


def _coloured_pixels(image) -> int:
    return sum(1 for p in image.getdata() if p != (255, 255, 255))


def test_examples_are_deterministic_and_differ_between_splits():
    a, b = shapes_example(3, seed=0), shapes_example(3, seed=0)
    assert a["image"].tobytes() == b["image"].tobytes() and a["shapes"] == b["shapes"]
    test = [shapes_example(i, split="test")["image"].tobytes() for i in range(20)]
    train = [shapes_example(i, split="train")["image"].tobytes() for i in range(20)]
    assert not set(test) & set(train)
    assert shapes_example(3, seed=1)["shapes"] != a["shapes"]


def test_the_splits_share_no_image_whatever_the_seeds():
    """Training shapes sit at even offsets in their cells, test shapes at odd ones, 2 pixels from the edges."""
    cell = IMAGE_SIZE // 2
    for split, parity in (("train", 0), ("test", 1)):
        for seed in (0, 1):
            for i in range(60):
                for _kind, _colour, x, y, size in shapes_example(i, seed=seed, split=split)["shapes"]:
                    for off in (x % cell, y % cell):
                        assert off % 2 == parity and 2 <= off <= cell - size - 2, (split, seed, i, off, size)


def test_each_shape_is_drawn_apart_in_its_cell_and_the_count_is_what_is_drawn():
    counts = set()
    for i in range(40):
        ex = shapes_example(i)
        counts.add(ex["count"])
        assert ex["image"].size == (IMAGE_SIZE, IMAGE_SIZE) and len(ex["shapes"]) == ex["count"]
        # one shape per 28x28 cell: the connected coloured blobs are the shapes, counted from the pixels
        cells = {(x // (IMAGE_SIZE // 2), y // (IMAGE_SIZE // 2)) for x in range(IMAGE_SIZE) for y in range(IMAGE_SIZE)
                 if ex["image"].getpixel((x, y)) != (255, 255, 255)}
        assert len(cells) == ex["count"], (i, ex["shapes"])
    assert counts == {1, 2, 3, 4}


def test_a_square_fills_its_box_in_its_colour_and_bad_shapes_are_refused():
    image = draw_shapes([("square", "blue", 4, 6, 10)])
    assert _coloured_pixels(image) == 11 * 11  # Pillow's rectangle includes both corners
    assert image.getpixel((9, 10)) == COLOURS["blue"]
    with pytest.raises(ValueError, match="'hexagon'.*expected a kind"):
        draw_shapes([("hexagon", "blue", 4, 6, 10)])


def test_answers_read_as_the_arithmetic_tasks_closing_sentence():
    from trainer.data.tasks.arithmetic import extract_answer

    assert shapes_answer(1) == "There is 1 shape. The answer is 1."
    assert extract_answer(shapes_answer(3)) == 3 and extract_answer(shapes_answer(1)) == 1

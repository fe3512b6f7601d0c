"""Each benchmark's scorer on hand-picked answers, against what its published evaluator does with them: MathVista's
letters, option texts, units, integer and float precision (lupantech/MathVista calculate_score.py), MathVerse's
letters and math answers, EasyR1's boxed Geometry3K answers, R1-V's SuperCLEVR regex, RefCOCO boxes in each model
family's coordinate convention at IoU > 0.5 from the answer block (VLM-R1 test_rec_r1.py), V*'s option letters,
Visual-RFT's classification containment test; and the registry."""

import pytest

from vlmrl.errors import ConfigError
from vlmrl.eval.benchmarks import BENCHMARKS, categories, parse_benchmark, resolve_benchmark
from vlmrl.eval.benchmarks.extract import choice_letter, final_answer, levenshtein
from vlmrl.eval.benchmarks.geometry3k import geometry3k_score
from vlmrl.eval.benchmarks.mathverse import score as mathverse_score
from vlmrl.eval.benchmarks.mathvista import normalize
from vlmrl.eval.benchmarks.mathvista import score as mathvista_score
from vlmrl.eval.benchmarks.refcoco import box_convention, predicted_box
from vlmrl.eval.benchmarks.refcoco import score as refcoco_score
from vlmrl.eval.benchmarks.superclevr import superclevr_score
from vlmrl.eval.benchmarks.virft import virft_accuracy
from vlmrl.eval.benchmarks.vstar import score as vstar_score

COMPARE = ["larger than", "equal to", "smaller than"]
ANGLES = ["30", "45", "60", "90"]


def mathvista(answers, answer, qtype, atype, choices=None, precision=None):
    n = len(answers)
    return mathvista_score(answers, [answer] * n, question_type=[qtype] * n, mathvista_answer_type=[atype] * n,
                           choices=[choices or []] * n, precision=[precision] * n)


def test_mathvista_multiple_choice_letters_and_option_texts():
    answers = ["B", "(B) equal to", "equal to", "The answer is B.", "<think>maybe (A)</think><answer>B</answer>",
               "The answer is A.", "(C)", "equal"]
    # "equal" is no option: calculate_score.py maps any text to the option nearest by edit distance
    assert mathvista(answers, "equal to", "multi_choice", "text", COMPARE) == [1, 1, 1, 1, 1, 0, 0, 1]
    # numeric options: a letter is its option's text; "45°" is nearest to "45"; "C" is 60
    assert mathvista(["B", "45°", "C", "45"], "45", "multi_choice", "text", ANGLES) == [1, 1, 0, 1]


def test_mathvista_integers_floats_units_and_lists():
    ints = ["3", "There are 3 red blocks.", "3.0", "\\boxed{3}", "\\boxed{4}", "", "three"]
    assert mathvista(ints, "3", "free_form", "integer") == [1, 1, 1, 1, 0, 0, 0]
    assert mathvista(["1,000 people"], "1000", "free_form", "integer") == [1]
    # floats rounded to the problem's precision before the string comparison, as calculate_score.py does
    floats = ["2.50", "The length is 2.54 cm", "2.6", "Answer: 2.5 cm", "2.46"]
    assert mathvista(floats, "2.5", "free_form", "float", precision=1.0) == [1, 1, 0, 1, 1]
    assert mathvista(["[1, 2, 3]", "[1,2,3]"], "[1, 2, 3]", "free_form", "list") == [1, 0]  # compared as strings


def test_mathvista_normalize_matches_calculate_score():
    assert normalize("(A) text", COMPARE, "multi_choice", "text", None) == "larger than"
    assert normalize("D", COMPARE, "multi_choice", "text", None) == "equal to"  # no option D: the nearest text
    assert normalize("7.0", [], "free_form", "integer", None) == "7"
    assert normalize("seven", [], "free_form", "integer", None) is None
    assert normalize("0.333", [], "free_form", "float", 2.0) == "0.33"
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "ab") == 2


def test_mathverse_letters_and_math_answers():
    n = 4
    assert mathverse_score(["B", "(B)", "Answer: C", "The answer is B."], ["B"] * n,
                           question_type=["multi-choice"] * n) == [1, 1, 0, 1]
    assert mathverse_score(["0.5", "so \\boxed{\\dfrac{1}{2}}", "1/3"], ["\\frac{1}{2}"] * 3,
                           question_type=["free-form"] * 3) == [1, 1, 0]
    assert mathverse_score(["The answer is 25.", "24"], ["25"] * 2, question_type=["free-form"] * 2) == [1, 0]


def test_mathverse_prompt_is_the_w_o_query():
    """MathVerse's README: the 'w/o' accuracy, on answers to `query_wo`, is the leaderboard's primary metric."""
    from vlmrl.eval.benchmarks.mathverse import adapt

    row = {"sample_index": "1", "problem_index": "1", "problem_version": "Vision Only", "image": b"", "answer": "B",
           "question_type": "multi-choice", "metadata": {"subject": "Plane Geometry", "subfield": "Angle"},
           "query_wo": "Please directly answer the question ...", "query_cot": "Please first conduct reasoning ..."}
    assert adapt(row)["problem"] == row["query_wo"]


def test_visual_rft_classification_containment():
    """Visual-RFT grpo_classification.py: the one-line answer tag's content (else the response) and the label, without
    spaces and underscores and lower-cased, are right when either contains the other; an empty answer pays 0 here."""
    answers = ["<think>petals</think><answer>Pink Primrose</answer>", "<answer>pink_primrose flower</answer>",
               "<answer>primrose</answer>", "<answer>rose</answer>", "it is a pink primrose",
               "<answer>\npink primrose\n</answer>", "<answer></answer>", "<answer>sweet pea</answer>"]
    n = len(answers)
    # containment both ways pays a part of the name ("rose" is in "pinkprimrose"), as Visual-RFT's does; a multi-line
    # tag is not found (no DOTALL), so the whole response is the answer and contains the label
    assert virft_accuracy(answers, ["<answer>pink primrose</answer>"] * n) == [1, 1, 1, 1, 1, 1, 0, 0]
    assert virft_accuracy(["<answer>daisy</answer>"], [""]) == [None]


def test_geometry3k_reads_the_last_boxed_answer_as_easyr1():
    answers = ["<think>x^2 = 18</think> so x = \\boxed{3\\sqrt{2}}", "\\boxed{\\sqrt{18}}", "<answer>3\\sqrt{2}</answer>",
               "\\boxed{2} no, \\boxed{3\\sqrt{2}}", "\\boxed{4}"]
    assert geometry3k_score(answers, ["3\\sqrt{2}"] * 5) == [1, 1, 0, 1, 0]


def test_superclevr_uses_r1v_regex():
    answers = ["<think>count</think><answer>5</answer>", "<answer> 5 </answer>", "<answer>5 items</answer>",
               "<answer>3</answer> wait <answer>5</answer>", "5", "<answer>05</answer>"]
    assert superclevr_score(answers, ["5"] * 6) == [1, 1, 0, 0, 0, 1]


def test_refcoco_boxes_in_each_family_convention():
    gold, w, h = "[10, 8, 40, 28]", 64, 48
    grid = "<answer>[156, 167, 625, 583]</answer>"  # Qwen2-VL: the gold box on the 0..1000 grid
    tokens = "<answer><|box_start|>(156,167),(625,583)<|box_end|></answer>"
    assert refcoco_score([grid, tokens], [gold] * 2, width=[w] * 2, height=[h] * 2,
                         box_convention=["grid1000"] * 2) == [1, 1]
    # the same grid numbers read as pixels are outside the image; box tokens are always on the grid
    assert refcoco_score([grid, tokens], [gold] * 2, width=[w] * 2, height=[h] * 2,
                         box_convention=["pixels"] * 2) == [0, 1]
    # Qwen2.5-VL: pixels of the resized input (640x480 shown to the model as 112x84)
    qwen25 = '<answer>```json\n[{"bbox_2d": [17, 14, 70, 49], "label": "cup"}]\n```</answer>'
    big = "[100, 80, 400, 280]"
    kw = dict(width=[640], height=[480], input_width=[112], input_height=[84])
    assert refcoco_score([qwen25], [big], box_convention=["input_pixels"], **kw) == [1]
    assert refcoco_score([qwen25], [big], box_convention=["pixels"], **kw) == [0]
    assert box_convention("qwen2_5_vl") == "input_pixels" and box_convention("qwen2_vl") == "grid1000"
    assert box_convention("llava") == "pixels"


def test_refcoco_iou_threshold_and_answer_block():
    """VLM-R1's test_rec_r1.py: the box is read from the first <answer> block only and pays when IoU > 0.5."""
    gold = "[0, 0, 10, 10]"
    answers = ["<answer>[0, 0, 10, 5.1]</answer>", "<answer>[0, 0, 10, 5]</answer>",
               "<think>[0, 0, 1, 1]</think><answer>[0, 0, 10, 10]</answer>", "<answer>no box</answer>",
               "<answer>[10, 10, 0, 0]</answer>", "<answer>[50, 50, 60, 60] [0, 0, 10, 10]</answer>",
               "[0, 0, 10, 10]", "<think>[0, 0, 10, 10]</think> no answer block",
               '<answer>{"bbox_2d": [0, 0, 10, 10]}</answer> <answer>[50, 50, 60, 60]</answer>']
    n = len(answers)
    # IoU 0.51 passes, exactly 0.5 fails (strict >); a box outside any <answer> block is no answer; an inverted box
    # never pays; the last box of the first block counts (VLM-R1's greedy pattern)
    assert refcoco_score(answers, [gold] * n, width=[100] * n, height=[100] * n) == [1, 0, 1, 0, 0, 1, 0, 0, 1]
    assert predicted_box("<answer>[0.1, 0.2, 0.5, 0.6]</answer>", 100, 50, "normalized") == pytest.approx(
        (10, 10, 50, 30))
    assert predicted_box("[0.1, 0.2, 0.5, 0.6]", 100, 50, "normalized") is None


def test_vstar_option_letters():
    answers = ["A", "(A) red", "The answer is A.", "A or B", "red", "<answer>B</answer>"]
    assert vstar_score(answers, ["A"] * 6) == [1, 1, 1, 0, 0, 0]


def test_extraction_rules():
    assert final_answer("<think>x</think>work\n\\boxed{7}") == "7"
    assert final_answer("steps\nThe final answer is **12**.") == "12"
    assert final_answer("<answer>3</answer> trailing") == "3" and final_answer("a\nb\n") == "b"
    assert choice_letter("A or B", 4) is None and choice_letter("it is (C) green", 4) == "C"
    assert choice_letter("E", 4) is None


def test_categories_count_list_values_in_each_item():
    records = [{"answers_correct": [True], "lengths": [1], "truncated": [False], "vote": True,
                "reasoning_tokens": [None]},
               {"answers_correct": [False], "lengths": [1], "truncated": [False], "vote": False,
                "reasoning_tokens": [None]}]
    samples = [{"skills": ["algebra", "geometry"], "grade": "high"}, {"skills": ["geometry"], "grade": None}]
    out = categories(records, samples, ["skills", "grade", "absent"])
    assert out["skills"]["algebra"]["accuracy"] == 1.0 and out["skills"]["geometry"]["accuracy"] == 0.5
    assert out["skills"]["geometry"]["n"] == 2 and set(out["grade"]) == {"high"} and "absent" not in out


def test_registry_names_splits_and_unknowns():
    assert {"mathvista", "mathverse", "geometry3k", "superclevr", "refcoco", "refcoco+", "refcocog",
            "vstar"} <= set(BENCHMARKS)
    benchmark, split = parse_benchmark("refcoco@testA")
    assert benchmark.name == "refcoco" and split == "testA" and parse_benchmark("vstar")[1] is None
    for b in BENCHMARKS.values():
        assert b.source and b.columns and b.max_new_tokens > 0
    with pytest.raises(ConfigError, match="unknown benchmark 'mathvist'; built-in benchmarks: geometry3k"):
        resolve_benchmark("mathvist")
    with pytest.raises(ConfigError, match="file 'nope.py' not found"):
        resolve_benchmark("nope.py:x")


def test_docs_give_every_benchmark_and_seed_recipe():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs/benchmarks.md").read_text()
    for name in ("mathvista", "mathverse", "geometry3k", "superclevr", "refcoco", "refcoco+", "refcocog", "vstar"):
        assert f"`{name}`" in doc and BENCHMARKS[name].hub.split("/")[0] in doc
    for recipe in ("visual_rft_flower_4shot", "r1v_clevr_counting", "easyr1_geometry3k", "maye_geometry3k"):
        assert f"recipes/{recipe}.yaml" in doc and (root / "recipes" / f"{recipe}.yaml").exists()
        assert "UNTESTED ON A GPU" in (root / "recipes" / f"{recipe}.yaml").read_text()
    assert "--benchmark" in (root / "README.md").read_text()


def test_adapters_accept_the_variants_hub_copies_hold():
    from vlmrl.eval.benchmarks.refcoco import adapt as refcoco_row
    from vlmrl.eval.benchmarks.superclevr import superclevr_row

    assert superclevr_row({"image": b"", "question": "How many?", "ground_truth": "4"})["solution"] == "4"
    rows = refcoco_row({"question_id": "7", "image": b"", "answer": "['the cat', 'left cat']",
                        "bbox": [1.0, 2.0, 3.0, 4.0]})
    assert [r["expression"] for r in rows] == ["the cat", "left cat"] and rows[0]["solution"] == "[1, 2, 4, 6]"


# ---------------------------------------------------------------------------------------- issue 53: answers models give


def test_answer_stated_with_a_colon_or_on_the_next_line():
    """"The answer is: C" is C, not ": C"; "The correct answer is:" reads the next line (MathVista, MathVerse, V*)."""
    assert final_answer("The answer is: C") == "C" and final_answer("The correct answer is:\n\n(B) No") == "(B) No"
    assert mathvista(["The answer is: C", "Sure! The answer to the question is:\n\n(C) 60"], "60", "multi_choice",
                     "text", ANGLES) == [1, 1]
    assert mathverse_score(["The answer is: C", "The correct answer is:\nC"], ["C"] * 2,
                           question_type=["multi-choice"] * 2) == [1, 1]
    assert vstar_score(["The answer is: B", "The correct answer is:\n(B) black"], ["B"] * 2) == [1, 1]


def test_mathverse_golds_with_a_label_and_unit():
    """MathVerse's judge counts a bare value right against "Area $=113.1 \\mathrm{~cm}^{2}$" (and the labelled form)."""
    golds = ["Area $=113.1 \\mathrm{~cm}^{2}$", "Area $=113.1 \\mathrm{~cm}^{2}$", "Area $=113.1 \\mathrm{~cm}^{2}$",
             "$r=7.00$", "$5=s$", "2191.7 metres", "Area $=9 \\pi \\mathrm{cm}^{2}$",
             "\\frac{1225\\pi }{2} \\text { units }^2", "y=-2 x+5"]
    answers = ["113.1", "Area = 113.1 cm^2", "113", "7", "5", "2191.7", "9\\pi", "\\frac{1225\\pi}{2}", "y=-2x+5"]
    n = len(golds)
    assert mathverse_score(answers, golds, question_type=["free-form"] * n) == [1, 1, 0, 1, 1, 1, 1, 1, 1]


def test_letter_beside_capitalised_text():
    """A marked letter names its option whatever follows it (V*, MathVerse option lines)."""
    answers = ["(B) A white cup", "B. Since O is the center", "(B) because (A) is too small", "B: The red one"]
    n = len(answers)
    assert vstar_score(answers, ["B"] * n) == [1] * n
    assert mathverse_score(answers, ["B"] * n, question_type=["multi-choice"] * n) == [1] * n
    assert choice_letter("(A) or (B)", 4) is None and choice_letter("A white cup", 4) is None


def test_markdown_and_a_letter_that_ends_the_answer():
    """lmms-eval's V* reader takes "**B**" and "I think it's B" as B; "A or B" still names no one option."""
    answers = ["**B**", "I think it's B", "I think it's B.", "A or B", "**(B)** black"]
    assert vstar_score(answers, ["B"] * 5) == [1, 1, 1, 0, 1]
    assert mathverse_score(answers[:2], ["B"] * 2, question_type=["multi-choice"] * 2) == [1, 1]


def test_mathverse_multiple_choice_golds_that_are_not_one_letter():
    """Golds "False" (an option's text), "090^\\circ T" and "C\\nD" (two answers) are scored, never None."""
    from vlmrl.eval.benchmarks.mathverse import options_in

    bearing = options_in("Find the true bearing.\nChoice:\nA. 090^\\circ T\nB. 180^\\circ T\nC. 049^\\circ T")
    true_false = options_in("True or false: the side is opposite.\nChoice:\nA. True\nB. False")
    assert bearing == ["090^\\circ T", "180^\\circ T", "049^\\circ T"] and true_false == ["True", "False"]
    answers = ["A", "B", "B", "False", "A", "C, D", "C and D", "C"]
    golds = ["090^\\circ T", "090^\\circ T", "False", "False", "False", "C\nD", "C\nD", "C\nD"]
    options = [bearing, bearing, true_false, true_false, true_false, [], [], []]
    n = len(answers)
    assert mathverse_score(answers, golds, question_type=["multi-choice"] * n,
                           mathverse_options=options) == [1, 0, 1, 1, 0, 1, 1, 0]


def test_refcoco_box_past_the_image_edge_scores_by_its_iou():
    """VLM-R1 neither clips nor refuses a box past the edge: its IoU decides (here 0.97 with a 100 px image)."""
    gold = "[0, 0, 97, 50]"
    answers = ["<answer>[0, 0, 100, 50]</answer>", "<answer>[-3, 0, 97, 50]</answer>",
               "<answer>[0, 0, 400, 50]</answer>"]
    assert refcoco_score(answers, [gold] * 3, width=[97] * 3, height=[50] * 3) == [1, 1, 0]


def test_geometry3k_counts_a_boxed_answer_inside_think():
    """EasyR1's mathruler `extract_boxed_content` is `rfind("\\boxed{")` over the whole response, think included."""
    answers = ["<think>so x = \\boxed{3\\sqrt{2}}</think> done", "<think>\\boxed{4}</think> \\boxed{3\\sqrt{2}}",
               "<think>\\boxed{3\\sqrt{2}}</think> \\boxed{4}"]
    assert geometry3k_score(answers, ["3\\sqrt{2}"] * 3) == [1, 1, 0]

"""A picture of one rollout tree (PIL), for TensorBoard: one box per node, left to right by depth.

Boxes show the node's decoded text (truncated) and, below it, role, turn and token count; prompt nodes are grey,
assistant nodes blue, environment nodes orange. Each leaf is followed by its path's reward and why the path ended;
rewarded paths are drawn in green.
"""

from __future__ import annotations

from PIL import Image, ImageDraw, ImageFont

from rollout.tree import RolloutTree

__all__ = ["render_tree"]

BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 230, 36, 34, 10, 12
LABEL_W = 150
FILL = {"prompt": (225, 225, 225), "assistant": (205, 222, 250), "env": (252, 228, 200)}
REWARDED = (40, 150, 60)


def _text(tree: RolloutTree, index: int, tokenizer, max_chars: int) -> str:
    node = tree.nodes[index]
    text = tokenizer.decode(node.tokens.tolist(), skip_special_tokens=False)
    for marker in ("<|bos|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|call|>", "<|answer|>", "<|end|>"):
        text = text.replace(marker, {"<|call|>": "call:", "<|answer|>": "answer:", "<|tool|>": "tool:",
                                     "<|end|>": " /"}.get(marker, ""))
    text = " ".join(text.split())
    return text if len(text) <= max_chars else text[: max_chars - 1] + "~"


def render_tree(tree: RolloutTree, tokenizer, max_chars: int = 34) -> Image.Image:
    """RGB image of `tree` (text decoded with `tokenizer`)."""
    depth = {0: 0}
    order = []
    stack = [0]
    while stack:
        i = stack.pop()
        order.append(i)
        for c in reversed(tree.nodes[i].children):
            depth[c] = depth[i] + 1
            stack.append(c)
    leaves = [i for i in order if not tree.nodes[i].children]
    row = {leaf: k for k, leaf in enumerate(leaves)}
    for i in reversed(order):
        children = tree.nodes[i].children
        if children:
            row[i] = sum(row[c] for c in children) / len(children)
    path_reward = {leaf.index: sum(n.reward for n in tree.path(leaf.index)) for leaf in tree.leaves()}

    width = 2 * MARGIN + (max(depth.values()) + 1) * (BOX_W + GAP_X) + LABEL_W
    height = 2 * MARGIN + max(len(leaves), 1) * (BOX_H + GAP_Y) + 20
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    draw.text((MARGIN, MARGIN // 2), f"tree {tree.tree_id}: {len(tree.nodes)} nodes, {len(leaves)} paths, "
              f"{tree.num_tree_tokens()} tree / {tree.num_flat_tokens()} flat tokens", fill="black", font=font)

    def box(i: int) -> tuple[int, int]:
        return MARGIN + depth[i] * (BOX_W + GAP_X), MARGIN + 20 + int(row[i] * (BOX_H + GAP_Y))

    for i in order:
        node = tree.nodes[i]
        x, y = box(i)
        if node.parent is not None:
            px, py = box(node.parent)
            draw.line([(px + BOX_W, py + BOX_H // 2), (x, y + BOX_H // 2)], fill=(120, 120, 120), width=1)
        outline = REWARDED if node.reward > 0 else (90, 90, 90)
        draw.rectangle([x, y, x + BOX_W, y + BOX_H], fill=FILL[node.role], outline=outline, width=2)
        draw.text((x + 4, y + 3), _text(tree, i, tokenizer, max_chars), fill="black", font=font)
        draw.text((x + 4, y + 19), f"{node.role} t{node.turn} {node.tokens.size} tok", fill=(80, 80, 80), font=font)
        if not node.children:
            reward = path_reward[i]
            draw.text((x + BOX_W + 6, y + 11), f"reward {reward:g} ({node.end})",
                      fill=REWARDED if reward > 0 else (160, 40, 40), font=font)
    return image

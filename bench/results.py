"""bench/RESULTS.md: each benchmark replaces its own section in place, leaving the others."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, lines: list[str]) -> None:
    """`lines[0]` is the section's `# ` heading; it runs to the next top-level heading."""
    text, marker = path.read_text() if path.exists() else "", "\n" + lines[0] + "\n"
    if marker not in text:
        path.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n")
        return
    start, end = text.index(marker), text.find("\n# ", text.index(marker) + 1)
    path.write_text(text[:start] + "\n" + "\n".join(lines) + "\n" + (text[end:] if end != -1 else ""))


def svg_bars(panels: dict[str, dict[str, dict[str, float | None]]], title: str, colors: tuple[str, ...]) -> str:
    """Grouped bar charts side by side: one panel per metric ({panel: {group: {bar: value}}}), each with its own
    scale from 0; bars in the order of the first group, one color per bar name (a missing value: no bar)."""
    from xml.sax.saxutils import escape

    names = list(dict.fromkeys(b for groups in panels.values() for bars in groups.values() for b in bars))
    pw, h, top, bottom, gap = 240, 360, 50, 60, 50
    w = gap + len(panels) * (pw + gap)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" style="font: 12px sans-serif">',
             f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>']
    parts += [f'<rect x="{gap + 90 * i}" y="{h - 18}" width="10" height="10" fill="{colors[i % len(colors)]}"/>'
              f'<text x="{gap + 90 * i + 14}" y="{h - 9}">{escape(n)}</text>' for i, n in enumerate(names)]
    for p, (panel, groups) in enumerate(panels.items()):
        x0, values = gap + p * (pw + gap), [v for bars in groups.values() for v in bars.values() if v is not None]
        hi = max(values, default=1.0) * 1.1 or 1.0
        py = lambda v: h - bottom - (h - top - bottom) * v / hi  # noqa: E731
        parts += [f'<text x="{x0 + pw / 2}" y="{top - 12}" text-anchor="middle">{escape(panel)}</text>',
                  f'<path d="M{x0},{top} V{h - bottom} H{x0 + pw}" fill="none" stroke="black"/>']
        group_w = pw / max(1, len(groups))
        for g, (group, bars) in enumerate(groups.items()):
            bar_w = group_w * 0.8 / max(1, len(names))
            for i, name in enumerate(names):
                v = bars.get(name)
                if v is None:
                    continue
                x = x0 + g * group_w + group_w * 0.1 + i * bar_w
                parts.append(f'<rect x="{x:.1f}" y="{py(v):.1f}" width="{bar_w * 0.9:.1f}" '
                             f'height="{h - bottom - py(v):.1f}" fill="{colors[i % len(colors)]}"/>')
                parts.append(f'<text x="{x + bar_w * 0.45:.1f}" y="{py(v) - 3:.1f}" text-anchor="middle" '
                             f'font-size="9">{v:.3g}</text>')
            parts.append(f'<text x="{x0 + (g + 0.5) * group_w:.1f}" y="{h - bottom + 16}" '
                         f'text-anchor="middle">{escape(group)}</text>')
    return "\n".join(parts + ["</svg>"]) + "\n"

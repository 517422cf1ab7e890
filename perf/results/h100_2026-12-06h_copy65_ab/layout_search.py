"""How few integer instructions could decode 8 E2M1 codes (one 32-bit word) into 4 bf16x2
registers, if the load-time repack placed their bits freely (stop 50; not implemented).

A decoded pair needs its two 3-bit magnitudes at bf16 bits 6-8 and 22-24 and its signs at 15
and 31 (the kernel's trick: e2m1 * 2^-126, the scale multiply restores it). A pair stored as a
rotation of that pattern costs a shift (or none) and an AND; a pair whose magnitude and sign
need different rotations costs two logic ops plus its shifts. Rotations are shared between
pairs. The served decode spends 14 per word (2 PRMT, then AND, IMAD, AND a pair), plus 4 HMUL2.
Prints the cheapest layouts: cost, magnitude rotations, sign rotations.
"""

import itertools


def residues(rotation: int) -> set[int]:
    return {(6 - rotation) % 16, (7 - rotation) % 16, (8 - rotation) % 16}


def main() -> None:
    layouts = []
    for mags in itertools.product(range(32), repeat=4):
        if mags[0]:
            continue  # pair 0 unrotated: every layout has a rotated twin
        used: set[int] = set()
        for r in mags:
            if used & residues(r):
                break
            used |= residues(r)
        else:
            free = sorted(set(range(16)) - used)
            for order in itertools.permutations(free):
                for halves in itertools.product((0, 16), repeat=4):
                    signs = [((15 - p) % 16 + h) % 32 for p, h in zip(order, halves, strict=True)]
                    shifts = {r for r in (*mags, *signs) if r}
                    pairs = zip(mags, signs, strict=True)
                    cost = len(shifts) + sum(1 if m == s else 2 for m, s in pairs)
                    layouts.append((cost, mags, tuple(signs)))
    layouts.sort()
    print(layouts[:4])  # 11 logic ops a word at best (+ 4 HMUL2): 15 against the served 18


if __name__ == "__main__":
    main()

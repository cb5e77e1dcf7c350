"""The papers each objective implements: cited by title, authors and arXiv id (or the code the paper released, where
the text we hold gives no id), with BibTeX for a model card. ``../shared/papers/`` holds the texts raoe follows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reference:
    key: str  # BibTeX key
    authors: str  # "Last, First and Last, First"
    title: str
    year: int | None = None
    venue: str | None = None
    arxiv: str | None = None
    url: str | None = None  # where no arXiv id is known: the paper's released code or its page

    @property
    def link(self) -> str | None:
        return f"https://arxiv.org/abs/{self.arxiv}" if self.arxiv else self.url

    def short(self) -> str:
        """One line for tables: authors' last names, year, title, arXiv id or link."""
        names = [a.split(",")[0].strip() for a in self.authors.split(" and ")]
        who = names[0] + (" et al." if len(names) > 2 else "".join(f" & {n}" for n in names[1:]))
        where = f"arXiv:{self.arxiv}" if self.arxiv else self.url
        return ", ".join(str(x) for x in (who + (f" {self.year}" if self.year else ""), self.title, where) if x)

    def bibtex(self) -> str:
        fields = {"author": self.authors, "title": "{" + self.title + "}", "year": self.year,
                  "booktitle": self.venue, "eprint": self.arxiv, "archivePrefix": "arXiv" if self.arxiv else None,
                  "url": self.link}
        body = ",\n".join(f"  {k} = {{{v}}}" for k, v in fields.items() if v)
        return f"@{'inproceedings' if self.venue else 'misc'}{{{self.key},\n{body}\n}}"


RAOE = Reference("zhou2025raoe", "Zhou, Zicheng and Huang, Min and Miao, Qinghai",
                 "Rank-Awareness and Angular Constraints: A New Perspective on Learning Sentence Embeddings from NLI "
                 "Data")
ANGLE = Reference("li2023angle", "Li, Xianming and Li, Jing", "AnglE-optimized Text Embeddings", 2023,
                  arxiv="2309.12871")
COSENT = Reference("su2022cosent", "Su, Jianlin",
                   "CoSENT (1): A more effective sentence vector scheme than Sentence-BERT", 2022,
                   url="https://kexue.fm/archives/8847")
SIMCSE = Reference("gao2021simcse", "Gao, Tianyu and Yao, Xingcheng and Chen, Danqi",
                   "SimCSE: Simple Contrastive Learning of Sentence Embeddings", 2021,
                   "Proceedings of the 2021 Conference on Empirical Methods in Natural Language Processing",
                   arxiv="2104.08821")
SAN = Reference("san_hince", "SAN authors",
                "Syntactically Aligned Negative samples (SAN) and Hierarchical InfoNCE (HiNCE) for sentence "
                "representation learning", url="https://github.com/bcai01/SAN")
RANKED_LISTS = Reference("ranking_sentences", "RankingSentenceGeneration authors",
                         "Ranked sentence generation controlled in the latent space, with ListMLE post-training",
                         url="https://github.com/hly1998/RankingSentenceGeneration")
MARGIN_MSE = Reference("hofstaetter2020marginmse", "Hofst\u00e4tter, Sebastian and Althammer, Sophia and Schr\u00f6der, "
                       "Michael and Sertkan, Mete and Hanbury, Allan", "Improving Efficient Neural Ranking Models with "
                       "Cross-Architecture Knowledge Distillation", 2020, arxiv="2010.02666")
ROCKETQA_V2 = Reference("ren2021rocketqav2", "Ren, Ruiyang and Qu, Yingqi and Liu, Jing and Zhao, Wayne Xin and She, "
                        "Qiaoqiao and Wu, Hua and Wang, Haifeng and Wen, Ji-Rong", "RocketQAv2: A Joint Training "
                        "Method for Dense Passage Retrieval and Passage Re-ranking", 2021,
                        "Proceedings of the 2021 Conference on Empirical Methods in Natural Language Processing",
                        arxiv="2110.07367")
RSE = Reference("wang2022rse", "Wang, Bin and Li, Haizhou", "Relational Sentence Embedding for Flexible Semantic "
                "Matching", 2022, arxiv="2212.08802")

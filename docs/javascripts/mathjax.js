// MathJax 3 for the pages (pymdownx.arithmatex, generic mode, writes \( \) and
// \[ \] inside elements of class "arithmatex") and for the notebooks (whose
// markdown cells keep $ and $$).
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: "tex2jax_ignore|mathjax_ignore",
    processHtmlClass: "arithmatex|tex2jax_process",
  },
};

document$.subscribe(() => {
  MathJax.startup.output.clearCache();
  MathJax.typesetClear();
  MathJax.texReset();
  MathJax.typesetPromise();
});

() => {
  // Keyboard habits of A1111 users, on the page (Gradio runs this once when the page loads).
  //
  // Ctrl+Enter (Cmd+Enter on a Mac) in a prompt runs it: the Generate tab's prompt and negative
  // prompt click Generate; the img2img tab's click the run button of the panel that is shown.
  const runs = [
    [["#sd-prompt", "#sd-negative", "#sd-hires-prompt", "#sd-hires-negative"], ["#sd-generate"]],
    [["#sd-i2i-prompt", "#sd-i2i-negative"], ["#sd-i2i-run", "#sd-inpaint-run"]],
  ];
  const shown = (button) => button && button.offsetParent !== null && !button.disabled;
  document.addEventListener("keydown", (event) => {
    if (event.key !== "Enter" || !(event.ctrlKey || event.metaKey) || !(event.target instanceof Element)) return;
    for (const [fields, buttons] of runs) {
      if (!fields.some((field) => event.target.closest(field))) continue;
      event.preventDefault();  // no newline in the prompt
      const button = buttons.map((id) => document.querySelector(id)).find(shown);
      if (button) button.click();
      return;
    }
  }, true);

  // A LoRA weight typed into a card's number box and confirmed with Enter, or stepped with the
  // arrow keys (in the box or on the slider), re-weights at once, keeping the focus: Gradio sends a
  // slider's `release` only on pointer-up or blur, so the keys send the pointer-up it listens for.
  const steps = new Set(["Enter", "ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight", "PageUp", "PageDown",
                         "Home", "End"]);
  document.addEventListener("keyup", (event) => {
    const input = event.target;
    if (!steps.has(event.key) || !(input instanceof HTMLInputElement)) return;
    if (!input.closest(".sd-lora-card") || !["number", "range"].includes(input.type)) return;
    input.dispatchEvent(new PointerEvent("pointerup", { bubbles: true }));
  }, true);
}

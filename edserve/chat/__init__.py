"""Chat with Llama-3.2-Vision (Mllama): the Instruct prompt template, requests with images, and
the chat driver over an engine (:func:`edserve.chat.chat_api.chat`). Image and prompt
preprocessing for the model itself lives below, in :mod:`edserve.multimodal`."""
